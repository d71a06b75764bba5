"""How pdserve rides out failures, on a local CPU cluster of one prefill and two decode vLLM replicas.

For each fault, 8 greedy streams of 400 tokens start at once; when a replica has streams running (the
busiest decode replica, or the prefill replica while the streams' prefill legs and KV transfers are in
flight), the fault is injected there. Printed per fault: streams moved to another replica, whether every
output equals the run without the fault, the time from the fault to the replica leaving routing (every
router: it is read from the router's cluster status), and to a replacement serving.

    .venv/bin/python -m bench.failover [--faults decode_worker,frozen_engine]

Faults: decode_worker (SIGKILL of a decode replica's VLLM::Worker process), decode_engine_core (of its
VLLM::EngineCore), replica_actor (of the replica's actor process), frozen_engine (SIGSTOP of a decode
engine core: no error, no progress; the topology's hang_timeout_s is 3 s here), prefill_engine_core, router
(SIGKILL of the process of the router the streams' client is connected to, one of two sharing the port: the
SDK continues its streams on the other; "new request" is when a new client's first request succeeds, the
last column when Serve's replacement router serves too).
tests/e2e/test_faults.py runs the same faults and asserts on them.
"""

from __future__ import annotations

import argparse
import math
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import yaml

from bench.live.systems import topology
from cluster.bootstrap import APP_NAME, RunState
from pdserve_client.sdk import Completion, CompletionBuilder, GenerateFields, PdserveClient, PdserveError

REPO = Path(__file__).resolve().parents[1]
STREAMS = 8
MAX_TOKENS = 400  # long enough for a fault to land mid-stream
PROMPTS = [
    f"Agent {i}: summarise the failure log of build {i * 7919} and list the flaky tests. " * 12
    for i in range(STREAMS)
]
# Overrides of deploy/local.yaml, by dotted path.
TOPOLOGY = {
    "pools.decode.replicas": 2,
    "pools.decode.cpu.threads_bind": ["1", "0"],  # each decode engine a core of its own
    "pools.decode.hang_timeout_s": 3.0,  # a step of the tiny model takes milliseconds
    # Every request (and every continuation) takes the prefill -> NIXL -> decode path, cached or not.
    "router.mode": "disaggregate",
    "server.routers": 2,  # sharing the gRPC port: a router that dies leaves the other serving
}
ROUTERS = 2


def write_topology(out: Path) -> Path:
    out.write_text(yaml.safe_dump(topology(REPO / "deploy" / "local.yaml", TOPOLOGY)))
    return out


def request(prompt: str) -> GenerateFields:
    return GenerateFields(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def generate(client: PdserveClient, prompt: str) -> Completion:
    return client.generate_text(**request(prompt))


def wait_for(probe: Callable[[], object], timeout_s: float, what: str) -> object:
    """`probe()` until it returns something; a call the router cannot answer (it is being replaced) counts
    as nothing yet."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if (value := probe()) is not None:
                return value
        except PdserveError as exc:
            if exc.code != grpc.StatusCode.UNAVAILABLE:
                raise
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def ready(client: PdserveClient, role: str) -> dict[str, int]:
    """Replicas of `role` the router can use, with their running requests."""
    return {
        r.replica_id: r.running_requests
        for r in client.cluster_status()
        if r.role == role and r.state == "READY"
    }


def whole_cluster(client: PdserveClient) -> bool | None:
    return True if len(ready(client, "decode")) == 2 and len(ready(client, "prefill")) == 1 else None


class Streams:
    """STREAMS greedy requests at once, each on its own thread, counting the tokens each has received."""

    def __init__(self, client: PdserveClient) -> None:
        self.results: list[Completion | BaseException | None] = [None] * STREAMS
        self.tokens = [0] * STREAMS
        self.threads = [threading.Thread(target=self._run, args=(client, i)) for i in range(STREAMS)]
        for t in self.threads:
            t.start()

    def _run(self, client: PdserveClient, i: int) -> None:
        builder = CompletionBuilder()
        try:
            for response in client.generate(**request(PROMPTS[i])):
                builder.add(response)
                self.tokens[i] += len(response.token_ids)
            self.results[i] = builder.build()
        except BaseException as exc:
            self.results[i] = exc

    def answered(self) -> bool:
        """Every stream has had tokens and none has ended: a fault now lands mid-stream for all of them."""
        return all(self.tokens) and all(r is None for r in self.results)

    def join(self) -> list[Completion | BaseException | None]:
        for t in self.threads:
            t.join(timeout=600)
        return self.results


def busiest_decode(client: PdserveClient, streams: Streams) -> str | None:
    """The decode replica with the most streams running on it, once one has two (engine stats, 2 s)."""
    rid, n = max(ready(client, "decode").items(), key=lambda kv: kv[1], default=("", 0))
    return rid if n >= 2 else None


def any_prefill(client: PdserveClient, streams: Streams) -> str | None:
    # At once: the streams' prefill legs (and their KV transfers) are in flight.
    return next(iter(ready(client, "prefill")), None)


def serve_replicas(deployment: str) -> dict[str, int]:
    """The deployment's running Serve replicas: id -> actor process id."""
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    state = RunState.load()
    assert state is not None, "no cluster is up"
    details = ServeSubmissionClient(state.dashboard_url).get_serve_details()
    replicas = details["applications"][APP_NAME]["deployments"][deployment]["replicas"]
    return {str(r["replica_id"]): int(r["pid"]) for r in replicas if r["state"] == "RUNNING" and r.get("pid")}


def actor_pids(client: PdserveClient, role: str) -> dict[str, int] | None:
    """Serve's running replicas of `role` and their processes, once the dashboard lists every one in use:
    it may list a replacement seconds after the router has made it ready."""
    pids = serve_replicas(role)
    if role == "router":
        return pids if len(pids) == ROUTERS else None
    return pids if set(ready(client, role)) <= set(pids) else None


def router_when_answered(client: PdserveClient, streams: Streams) -> str | None:
    """The router the client's streams go through, once every stream has had tokens (a stream the router
    has not answered yet is not continued). Read from the client, not from engine stats: those lag by up to
    2 s, in which fast streams of the tiny model finished before the kill."""
    if not streams.answered():
        return None
    # The client's calls share one connection, so the router answering this one carries its streams.
    return next((r.router_id for r in client.routers() if r.answering), None)


def a_new_request_succeeds(target: str) -> str | None:
    """A new client (a new connection, which the kernel gives to a live router) gets an answer: the router
    that gave it."""
    with PdserveClient(target, timeout=10) as fresh:
        fresh.generate_text(prompt="are you there?", max_tokens=1)
        return next((r.router_id for r in fresh.routers() if r.answering), None)


def routers_replaced(killed: str) -> bool | None:
    """Serve runs ROUTERS routers again, none of them `killed`."""
    replicas = serve_replicas("router")
    return True if killed not in replicas and len(replicas) == ROUTERS else None


def engine_process(actor_pid: int, name: str) -> psutil.Process:
    """The replica's vLLM process called `name` (VLLM::EngineCore, or the VLLM::Worker it drives)."""
    children = psutil.Process(actor_pid).children(recursive=True)
    found = [p for p in children if p.name().startswith(name[:15])]  # the kernel may keep only 15 characters
    if len(found) != 1:
        raise LookupError(
            f"{name} of the replica in process {actor_pid}: {[(p.pid, p.name()) for p in children]}"
        )
    return found[0]


@dataclass
class Fault:
    """What to break, on which role, and when: `victim(client)` names the replica once the moment has come."""

    name: str
    role: str
    victim: Callable[[PdserveClient, Streams], str | None]
    stopped: psutil.Process | None = None

    def __repr__(self) -> str:
        return self.name

    def inject(self, actor_pid: int) -> None:
        """On the replica whose actor process is `actor_pid`."""
        if self.name in ("replica_actor", "router"):
            # The actor process dies at once (a crash, an OOM kill); an engine core follows it.
            psutil.Process(actor_pid).send_signal(signal.SIGKILL)
        elif self.name == "frozen_engine":
            self.stopped = engine_process(actor_pid, "VLLM::EngineCore")
            self.stopped.send_signal(signal.SIGSTOP)
        else:
            process = "VLLM::Worker" if self.name.endswith("worker") else "VLLM::EngineCore"
            engine_process(actor_pid, process).send_signal(signal.SIGKILL)

    def clean_up(self) -> None:
        """A frozen engine core outlives its replica (it cannot run its parent-death check)."""
        if self.stopped is not None and self.stopped.is_running():
            self.stopped.send_signal(signal.SIGKILL)


FAULTS = [
    Fault("decode_worker", "decode", busiest_decode),
    Fault("decode_engine_core", "decode", busiest_decode),
    Fault("replica_actor", "decode", busiest_decode),
    Fault("frozen_engine", "decode", busiest_decode),
    Fault("prefill_engine_core", "prefill", any_prefill),
    Fault("router", "router", router_when_answered),
]


@dataclass
class FaultResult:
    fault: str
    victim: str
    outputs: list[Completion | BaseException | None]
    moved: int
    out_of_routing_s: float
    replaced_s: float
    new_request_s: float = float("nan")  # the router fault: until a new client's request succeeds
    new_request_router: str = ""  # the router fault: the router that served that request


def run_fault(client: PdserveClient, fault: Fault, target: str) -> FaultResult:
    """Streams, the fault on its victim, then wait for the streams and for Serve's replacement."""
    wait_for(lambda: whole_cluster(client), 240, "the whole cluster ready")
    # Read before the streams start: the dashboard can take a second to answer on two loaded cores.
    actors = wait_for(
        lambda: actor_pids(client, fault.role), 60, f"the dashboard to list the {fault.role} replicas"
    )
    assert isinstance(actors, dict)
    streams = Streams(client)
    victim = wait_for(
        lambda: fault.victim(client, streams), 120, f"the moment to break a {fault.role} replica"
    )
    assert isinstance(victim, str)
    try:
        at = time.monotonic()
        if victim not in actors:
            raise LookupError(f"{victim} is not among the running {fault.role} replicas {sorted(actors)}")
        fault.inject(actors[victim])
        new_request_s = float("nan")
        new_request_router = ""
        if fault.role == "router":  # nothing routes to a router: "out of routing" does not apply
            out_of_routing_s = float("nan")
            served = wait_for(lambda: a_new_request_succeeds(target), 60, "a new request to succeed")
            new_request_s = time.monotonic() - at
            new_request_router = str(served)
            outputs = streams.join()
            wait_for(lambda: routers_replaced(victim), 240, "Serve to replace the router")
            replaced_s = time.monotonic() - at
        else:

            def gone() -> bool | None:
                return True if victim not in ready(client, fault.role) else None

            wait_for(gone, 60, "the victim to go")
            out_of_routing_s = time.monotonic() - at
            outputs = streams.join()
            wait_for(lambda: whole_cluster(client), 240, "Serve to replace the replica")
            replaced_s = time.monotonic() - at
    finally:
        fault.clean_up()
    router = fault.role == "router"
    moved_note = "the router connection was lost" if router else f"continued after {fault.role} replica"
    moved = sum(isinstance(c, Completion) and moved_note in c.served_by.note for c in outputs)
    return FaultResult(
        fault.name, victim, outputs, moved, out_of_routing_s, replaced_s, new_request_s, new_request_router
    )


def main(argv: list[str] | None = None) -> int:
    from bench.live.systems import LocalCluster
    from cluster.ray_auth import use_ray_token_auth

    use_ray_token_auth()  # this process reads Serve's view of the cluster from the dashboard

    parser = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", default=",".join(f.name for f in FAULTS))
    args = parser.parse_args(argv)
    chosen = [f for f in FAULTS if f.name in args.faults.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(write_topology(Path(tmp) / "topology.yaml"))
        try:
            topo = yaml.safe_load((Path(tmp) / "topology.yaml").read_text())
            target = f"127.0.0.1:{topo['server']['grpc_port']}"
            client = PdserveClient(target, timeout=300)
            wait_for(lambda: whole_cluster(client), 240, "the whole cluster ready")
            reference = [generate(client, p).token_ids for p in PROMPTS]
            print(
                f"cluster ready in {cluster.ready_s:.0f} s; {STREAMS} streams of {MAX_TOKENS} tokens a fault"
            )
            print(
                f"{'fault':<22}{'moved':>7}{'identical':>11}{'out of routing':>16}{'new request':>13}"
                f"{'replacement serving':>21}"
            )
            for fault in chosen:
                r = run_fault(client, fault, target)
                same = [c.token_ids if isinstance(c, Completion) else None for c in r.outputs] == reference
                gone = "-" if math.isnan(r.out_of_routing_s) else f"{r.out_of_routing_s:.2f}s"
                new = "-" if math.isnan(r.new_request_s) else f"{r.new_request_s:.2f}s"
                print(
                    f"{r.fault:<22}{f'{r.moved}/{STREAMS}':>7}{'yes' if same else 'NO':>11}"
                    f"{gone:>16}{new:>13}{r.replaced_s:>20.1f}s",
                    flush=True,
                )
            client.close()
        finally:
            cluster.down()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
