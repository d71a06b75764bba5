"""When `pdserve up` says the cluster is up, and what it says while it waits."""

from __future__ import annotations


def test_deploy_progress_names_each_starting_replica_its_age_and_what_it_waits_for() -> None:
    from cluster.readiness import deploy_progress

    now = 1000.0
    no_gpu = "Resources required for each replica: {'GPU': 8}, total resources available: {}."
    decode = {
        "status": "UPDATING",
        "target_num_replicas": 2,
        "message": "",
        "replicas": [
            {"replica_id": "d1", "state": "RUNNING", "start_time_s": 900.0},
            {"replica_id": "d2", "state": "STARTING", "start_time_s": 955.0, "node_ip": "10.0.0.7"},
        ],
    }
    prefill = {"status": "UPDATING", "target_num_replicas": 1, "message": no_gpu, "replicas": []}
    registry = {"status": "HEALTHY", "target_num_replicas": 1, "replicas": [{"state": "RUNNING"}]}
    router = {
        "status": "UPDATING",
        "target_num_replicas": 1,
        "replicas": [{"replica_id": "r1", "state": "STARTING", "start_time_s": 990.0}],
    }
    deployments = {"decode": decode, "prefill": prefill, "registry": registry, "router": router}
    details = {"applications": {"pdserve": {"deployments": deployments}}}
    assert deploy_progress(details, "pdserve", 61.2, now) == (
        "waiting for replicas (61 s): decode 1/2 running (replica d2 STARTING 45 s on 10.0.0.7: loading the "
        f"model and starting its vLLM engine); prefill 0/1 running [Serve: {no_gpu}]; router 0/1 running "
        "(replica r1 STARTING 10 s: loading the tokenizer and opening its endpoint)"
    )
    assert "not created" in deploy_progress({"applications": {}}, "pdserve", 3, now)
    assert "Serve status unavailable (TimeoutError: slow)" in deploy_progress(
        {"error": "TimeoutError: slow"}, "pdserve", 3, now
    )


def test_up_waits_until_every_router_routes_to_every_running_engine_replica() -> None:
    """The application runs before the routers have read the engines from the registry (every second):
    `pdserve up` says it is up only once every router serves and can route to every engine replica Serve
    runs. A router that saw only the decode replica would prefill the first requests on decode."""
    import pytest

    from cluster.bootstrap import BootstrapError
    from cluster.readiness import wait_until_serving
    from engine.messages import RouterReport

    both = {"prefill": 1, "decode": 1}

    def reports(*serving: bool, routable: dict[str, int] = both) -> list[RouterReport]:
        return [RouterReport(router_id=f"r{i}", serving=s, routable=routable) for i, s in enumerate(serving)]

    answers = iter(
        [[], reports(False, True), reports(True), reports(True, True, routable={"prefill": 0, "decode": 1})]
    )
    asked: list[int] = []

    def routers() -> list[RouterReport]:
        asked.append(1)
        answer = next(answers, reports(True, True))
        if not answer and len(asked) == 1:
            raise TimeoutError("the registry is starting")
        return answer

    wait_until_serving(routers, 2, lambda: both, timeout_s=10, poll_s=0.01)
    # No answer; one of two; one of two (the other not reporting yet); both serving but neither sees the
    # prefill replica; both.
    assert len(asked) == 5
    with pytest.raises(BootstrapError, match="1 of 2 routers route to every running engine replica"):
        wait_until_serving(lambda: reports(True, False), 2, lambda: both, timeout_s=0.1, poll_s=0.01)
    lagging = reports(True, routable={"decode": 2})
    with pytest.raises(BootstrapError, match="router r0 sees decode 2 of 3, prefill 0 of 1"):
        running = {"prefill": 1, "decode": 3}
        wait_until_serving(lambda: lagging, 1, lambda: running, timeout_s=0.1, poll_s=0.01)
    # A pool Serve runs no replica of (a prefill pool of 0) is not waited for.
    wait_until_serving(lambda: lagging, 1, lambda: {"decode": 2}, timeout_s=1, poll_s=0.01)
