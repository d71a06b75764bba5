"""When a deployed pdserve application is up: Serve runs every replica, and every router can route to every
engine replica. Until then, what each replica is waiting for, in pdserve's terms (an engine takes minutes to
load a large model; silence looks like a hang)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from cluster.bootstrap import BootstrapError
from engine.messages import RouterReport


def wait_until_running(
    app_name: str,
    timeout_s: float,
    *,
    dashboard_url: str | None = None,
    progress: Callable[[str], None] | None = None,
    every_s: float = 10.0,
) -> None:
    """Wait for the application to be RUNNING; on timeout say which deployments are not, and Serve's
    own reason (e.g. the resources it could not find), instead of hanging. Every `every_s` seconds,
    `progress` gets a line saying which replicas are still starting, for how long, and what they wait for
    (an engine takes minutes to load a large model; silence looks like a hang)."""
    from ray import serve

    started = time.monotonic()
    deadline = started + timeout_s
    next_report = started + every_s
    last = ""
    while time.monotonic() < deadline:
        status = serve.status()
        app = status.applications.get(app_name)
        if app is not None:
            if app.status == "RUNNING":
                return
            if app.status == "DEPLOY_FAILED":
                raise BootstrapError(f"application {app_name} failed to deploy: {app.message}")
            last = _describe_unready(app)
        now = time.monotonic()
        if progress is not None and dashboard_url is not None and now >= next_report:
            next_report = now + every_s
            progress(deploy_progress(_serve_details(dashboard_url), app_name, now - started, time.time()))
        time.sleep(1.0)
    raise BootstrapError(
        f"application {app_name} not running after {timeout_s:.0f} s: {last or 'no status yet'}"
    )


def wait_until_serving(
    routers: Callable[[], list[RouterReport]],
    want: int,
    running: Callable[[], dict[str, int]],
    timeout_s: float,
    *,
    poll_s: float = 0.25,
) -> None:
    """Wait until `want` routers (`routers()`: the registry's reports) serve and each can route to every
    engine replica Serve runs (`running()`, per role). Engine replicas publish to the registry after their
    constructor returns and routers read it every second: a router that serves once it sees a decode
    replica may not see the prefill one yet, and would prefill a first request on decode."""
    deadline = time.monotonic() + timeout_s
    last = "no router has reported yet"
    while time.monotonic() < deadline:
        try:
            reports, engines = routers(), running()
        except Exception as exc:  # the registry being (re)started: ask again
            last = f"the registry or Serve did not answer: {exc}"
        else:
            unseen = {r.router_id: _unseen(r, engines) for r in reports}
            ready = sum(1 for r in reports if r.serving and not unseen[r.router_id])
            if ready >= want:
                return
            lagging = "; ".join(f"router {rid} sees {what}" for rid, what in unseen.items() if what)
            last = f"{ready} of {want} routers route to every running engine replica"
            last += f" ({lagging})" if lagging else ""
        time.sleep(poll_s)
    raise BootstrapError(f"the routers do not serve after {timeout_s:.0f} s: {last}")


def _unseen(report: RouterReport, running: dict[str, int]) -> str:
    """The `running` engine replicas `report`'s router cannot route to yet ("" when none)."""
    seen = report.routable
    return ", ".join(
        f"{role} {seen.get(role, 0)} of {n}" for role, n in sorted(running.items()) if seen.get(role, 0) < n
    )


def running_engine_replicas(app_name: str) -> dict[str, int]:
    """Serve's RUNNING replicas of each engine pool of `app_name` (its deployments are named by role)."""
    from ray import serve
    from ray.serve.schema import ReplicaState

    app = serve.status().applications.get(app_name)
    if app is None:
        return {}
    return {
        role: dep.replica_states.get(ReplicaState.RUNNING, 0)
        for role, dep in app.deployments.items()
        if role in ("prefill", "decode")
    }


def _serve_details(dashboard_url: str) -> dict[str, Any]:
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    try:
        return dict(ServeSubmissionClient(dashboard_url).get_serve_details())
    except Exception as exc:  # progress is advisory: a slow dashboard must not stop the deploy
        return {"error": f"{type(exc).__name__}: {exc}"}


# What a replica in each Serve state is waiting for, in pdserve's terms.
_WAITING_FOR = {
    "STARTING": "loading the model and starting its vLLM engine",
    "UPDATING": "applying a new configuration",
    "RECOVERING": "being restarted after a failure",
    "PENDING_MIGRATION": "moving off a draining node",
}


def deploy_progress(details: dict[str, Any], app_name: str, elapsed_s: float, now: float) -> str:
    """One line: the replicas that are not yet running, each with its age and what it waits for, and
    Serve's own message for a deployment short of replicas (it names resources it cannot find)."""
    head = f"waiting for replicas ({elapsed_s:.0f} s)"
    if "error" in details:
        return f"{head}: Serve status unavailable ({details['error']})"
    app = (details.get("applications") or {}).get(app_name)
    if not app:
        return f"{head}: Serve has not created application {app_name} yet"
    parts = []
    for name, dep in sorted((app.get("deployments") or {}).items()):
        replicas = dep.get("replicas") or []
        running = sum(r.get("state") == "RUNNING" for r in replicas)
        target = (dep.get("target_num_replicas") or len(replicas)) or 0
        if dep.get("status") == "HEALTHY" and running >= target:
            continue
        waits = []
        for r in replicas:
            state = str(r.get("state"))
            if state == "RUNNING":
                continue
            age = now - float(r.get("start_time_s") or now)
            where = f" on {r['node_ip']}" if r.get("node_ip") else ""
            why = _WAITING_FOR.get(state, state.lower())
            if name == "router" and state == "STARTING":
                why = "loading the tokenizer and opening its endpoint"
            waits.append(f"replica {r.get('replica_id')} {state} {age:.0f} s{where}: {why}")
        line = f"{name} {running}/{target} running"
        if waits:
            line += " (" + "; ".join(waits) + ")"
        message = (dep.get("message") or "").strip()
        if message and len(replicas) < target:
            line += f" [Serve: {message[:300]}]"
        parts.append(line)
    settling = "every replica is running; the application is settling"
    return f"{head}: " + ("; ".join(parts) if parts else settling)


def _describe_unready(app: Any) -> str:
    parts = []
    for name, dep in app.deployments.items():
        if dep.status != "HEALTHY":
            parts.append(f"deployment {name} is {dep.status}: {dep.message or 'starting replicas'}")
    return "; ".join(parts) or f"application status {app.status}: {app.message}"
