"""The router process routes with the topology's router section and follows a new one in place."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from cluster.topology import Topology, served_model
from cluster.topology_file import parse_topology
from engine.messages import Sampling, StreamBatch
from engine.tiny_model import ensure_tiny_model
from router import process as app
from router.config import RouterConfig
from router.errors import Overloaded
from router.policy.cache_blind import RoundRobinPolicy
from router.process import RouterProcess


class _Handle:
    """Stands in for a Serve deployment handle (nothing is called in these tests)."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"unexpected call {name}")


@pytest.fixture
def process(monkeypatch: pytest.MonkeyPatch) -> RouterProcess:
    monkeypatch.setattr(app.serve, "get_deployment_handle", lambda *a, **k: _Handle())
    topo = parse_topology("router: {local_prefill_max_tokens: 64, stream_batch_tokens: 4}")
    return RouterProcess(
        served_model(topo.model),
        topo.router,
        topo.server,
        model_dir=ensure_tiny_model(),
        app_name="pdserve",
        has_prefill=True,
    )


def test_the_router_section_reaches_the_policy_and_the_request_path(process: RouterProcess) -> None:
    assert process.policy.config.local_prefill_max_tokens == 64
    assert process.legs._stream() == StreamBatch(tokens=4, ms=20.0)
    assert process.view.load.timing == Topology().router.service_time.timing()


def test_every_router_setting_applies_in_place(process: RouterProcess) -> None:
    # A session placed before the change keeps its state: nothing restarts.
    process.policy._remember("s", None, "d0", None, 0)
    assert process.policy.sessions is process.sessions
    changed = msgspec.convert(
        {
            "mode": "disaggregate",
            "policy": "round_robin",
            "prefill_weight": 9,
            "overload_queue_tokens": 10,
            "stream_batch_tokens": 2,
            "stream_batch_ms": 5,
            "failover_attempts": 0,
            "service_time": {"gpus_per_replica": 4},
        },
        RouterConfig,
    )
    process.reconfigure(changed)
    assert process.config.current == changed
    assert process.policy.config == changed and process.policy.weights.prefill == 9.0
    assert process.view.load.timing == changed.service_time.timing()
    assert process.legs._stream() == StreamBatch(tokens=2, ms=5.0)
    assert isinstance(process.decider._policy, RoundRobinPolicy)  # the cache-blind baseline decides
    # Admission reads the new limit at the next request.
    process.view.load.add_replica("d0", "decode")
    process.decider.route("r0", None, list(range(8)), Sampling(max_tokens=1))
    with pytest.raises(Overloaded, match="limit 10"):
        process.decider.route("r1", None, list(range(8)), Sampling(max_tokens=1))
    assert "s" in process.sessions


def test_every_router_policy_a_topology_can_name_is_one_the_router_runs(process: RouterProcess) -> None:
    import typing

    from router.config import RouterPolicy

    for name in typing.get_args(RouterPolicy):
        process.reconfigure(msgspec.convert({"policy": name}, RouterConfig))
        assert process.decider._policy.name == name


def test_status_says_ready_only_once_this_router_routes_to_the_replica() -> None:
    from replicas import replica_info

    info = replica_info("d1", ready=True)
    state = {
        (routed, failed): app._replica_status(info, routed=routed, failed=failed).state
        for routed in (True, False)
        for failed in (True, False)
    }
    # Registered but not yet in the router's view: STARTING; seen failing by the router: FAILED at once.
    assert state == {
        (True, False): "READY",
        (False, False): "STARTING",
        (True, True): "FAILED",
        (False, True): "FAILED",
    }


async def test_each_poll_reports_this_routers_load_and_admission_counts_the_others(
    process: RouterProcess,
) -> None:
    from inprocess_server import StandInRegistry
    from replicas import replica_info

    from engine.messages import RouterReport

    registry = StandInRegistry([replica_info("p0", "prefill"), replica_info("d0")])
    process.view._registry = registry
    process.config.current = msgspec.structs.replace(process.config.current, overload_queue_tokens=1000)
    await process.view.refresh()
    # The first poll's report went out before this router had read the replicas.
    assert registry.reports[-1].routable == {"prefill": 0, "decode": 0}
    process.decider.route("r1", None, list(range(300)), Sampling(max_tokens=4))
    await process.view.refresh()
    report = registry.reports[-1]
    assert report.router_id == process.view.router_id and report.admitted_tokens == 300
    assert report.routable == {"prefill": 1, "decode": 1}
    assert report.grpc_address == "127.0.0.1:50051" and report.inflight_requests == 1
    assert sum(d.active_seqs for d in report.replicas.values()) == 1
    # Another router has 600 prompt tokens in flight on d0: this one's views and admission count them.
    other = RouterReport(router_id="other", admitted_tokens=600, replicas={})
    registry.routers = [other, report]  # the registry answers a router with the others; its own is skipped
    await process.view.refresh()
    assert [r.router_id for r in process.view.peers] == ["other"]
    with pytest.raises(Overloaded, match="900 prompt tokens in flight"):
        process.decider.route("r2", None, list(range(200)), Sampling(max_tokens=4))
    registry.routers = []
    await process.view.refresh()
    process.decider.route("r2", None, list(range(200)), Sampling(max_tokens=4))


async def test_the_registry_poll_applies_the_deployed_router_settings_once_each(
    process: RouterProcess, caplog: pytest.LogCaptureFixture
) -> None:
    from inprocess_server import StandInRegistry

    registry = StandInRegistry(entries=[])
    process.view._registry = registry
    await process.view.refresh()  # nothing deployed: the topology's settings stay
    assert process.legs._stream() == StreamBatch(tokens=4, ms=20.0)
    registry.router_settings = {"stream_batch_tokens": 2}  # `pdserve apply` changed a setting
    await process.view.refresh()
    assert process.legs._stream() == StreamBatch(tokens=2, ms=20.0)
    registry.router_settings = {"stream_batch_tokens": 2, "policy": "no_such_policy"}  # a hand-made deploy
    with caplog.at_level("ERROR", logger=app.__name__):
        await process.view.refresh()
        await process.view.refresh()
    assert process.config.current.stream_batch_tokens == 2 and process.config.current.policy == "pdserve"
    refused = [r for r in caplog.records if "deployed router settings refused" in r.getMessage()]
    assert len(refused) == 1  # said once, not at every poll
    assert "no_such_policy" in refused[0].getMessage()
