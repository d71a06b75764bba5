"""`pdserve status [--json]`: every engine replica with its role, state, node, GPUs, placement group and load,
and every router with its state and the requests it has in flight.

It joins three views, keyed by the names the Ray dashboard shows, so a row can be found in the dashboard's
Serve and placement-group pages:
- Serve's application details (REST `GET /api/serve/applications/`): replica id, state, node, and the
  replica actor's name `SERVE_REPLICA::<app>#<deployment>#<replica id>`;
- Ray's state API (placement groups, named like the replica actor): placement group id, state, GPUs;
- pdserve's replica registry: readiness, draining, and load (running / waiting requests, KV cache usage);
  for a router, what it reported last: serving or not, and its requests in flight (RUN).
A replica the registry still lists but Serve no longer has is shown as GONE until its entry expires.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from engine import start_phases
from engine.messages import ReplicaInfo, RouterReport

ENGINE_DEPLOYMENTS = ("prefill", "decode")
ROUTER_DEPLOYMENT = "router"


class ReplicaRow(msgspec.Struct, frozen=True, kw_only=True):
    replica_id: str  # Serve's replica id (the dashboard's Serve view)
    role: str  # the deployment: prefill | decode | router
    state: str  # Serve's replica state (STARTING, RUNNING, STOPPING, ...) or GONE
    # ready | starting | draining | missing (not yet / no longer published) | failed: <reason>;
    # a router: serving | not serving | missing
    registry: str
    node_id: str | None
    node_ip: str | None
    actor_name: str | None  # SERVE_REPLICA::<app>#<deployment>#<replica id>
    placement_group_id: str | None
    placement_group_state: str | None  # CREATED | PENDING | RESCHEDULING
    gpus: float
    bundles: int
    running: int | None
    waiting: int | None
    kv_cache_usage: float | None
    # Seconds each phase of its start took (engine/start_phases.py); empty while unknown.
    start_phases: dict[str, float] = {}


class ClusterStatus(msgspec.Struct, frozen=True, kw_only=True):
    app_name: str
    app_status: str | None
    app_message: str
    deployments: dict[str, str]  # deployment -> Serve's status (and its message when not HEALTHY)
    replicas: list[ReplicaRow]
    # Why the registry's view (readiness, load) is missing, when it is ("" when it was read).
    registry_unread: str = ""


class Published(msgspec.Struct, frozen=True, kw_only=True):
    """What status shows of a replica's registry entry, read from the registry itself (on a Ray node) or
    through the router's GetClusterStatus (from anywhere its endpoint is reachable)."""

    replica_id: str
    role: str
    node_id: str
    registry: str  # ready | starting | draining | failed: <reason>
    running: int | None = None
    waiting: int | None = None
    kv_cache_usage: float | None = None
    start_phases: dict[str, float] = {}

    @classmethod
    def of_info(cls, info: ReplicaInfo) -> Published:
        s = info.stats
        return cls(
            replica_id=info.replica_id,
            role=info.role,
            node_id=info.node_id,
            registry=_registry_state(info),
            running=s.running if s else None,
            waiting=s.waiting if s else None,
            kv_cache_usage=s.kv_cache_usage if s else None,
            start_phases=dict(info.start_phases),
        )

    @classmethod
    def of_router(cls, report: RouterReport | Any) -> Published:
        """A router's report to the registry (a `RouterReport`, or the router's `pdserve.v1.Router`)."""
        return cls(
            replica_id=report.router_id,
            role=ROUTER_DEPLOYMENT,
            node_id=report.node_id,
            registry="serving" if report.serving else "not serving",
            running=report.inflight_requests,
        )

    @classmethod
    def of_replica(cls, replica: Any) -> Published:
        """From the router's `pdserve.v1.Replica` (its state READY | STARTING | DRAINING | FAILED)."""
        return cls(
            replica_id=replica.replica_id,
            role=replica.role,
            node_id=replica.node_id,
            registry=str(replica.state).lower(),
            running=replica.running_requests,
            waiting=replica.waiting_requests,
            kv_cache_usage=replica.kv_cache_usage,
            start_phases=dict(replica.start_phases_s),
        )


def collect_status(
    dashboard_url: str,
    app_name: str,
    registry: list[Published],
    *,
    registry_unread: str = "",
    timeout_s: float = 10.0,
) -> ClusterStatus:
    """Blocking (HTTP to the dashboard): call from a thread in async code."""
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient
    from ray.util.state import list_placement_groups

    details = ServeSubmissionClient(dashboard_url).get_serve_details()
    groups = list_placement_groups(address=dashboard_url, detail=True, limit=10_000, timeout=int(timeout_s))
    by_name = {g.name: g for g in groups if g.state != "REMOVED"}
    status = build_status(app_name, details, by_name, registry)
    return msgspec.structs.replace(status, registry_unread=registry_unread)


def build_status(
    app_name: str, details: dict[str, Any], groups: dict[str, Any], registry: list[Published]
) -> ClusterStatus:
    """Join Serve's details, placement groups by name, and registry entries (no I/O)."""
    app = (details.get("applications") or {}).get(app_name) or {}
    published = {info.replica_id: info for info in registry}
    rows: list[ReplicaRow] = []
    deployments: dict[str, str] = {}
    for name, dep in (app.get("deployments") or {}).items():
        if name not in (*ENGINE_DEPLOYMENTS, ROUTER_DEPLOYMENT):
            continue
        status = str(dep.get("status"))
        deployments[name] = status if status == "HEALTHY" else f"{status}: {dep.get('message') or ''}".strip()
        for replica in dep.get("replicas") or []:
            rid = str(replica.get("replica_id"))
            actor_name = replica.get("actor_name") or f"SERVE_REPLICA::{app_name}#{name}#{rid}"
            rows.append(
                _row(
                    name,
                    rid,
                    str(replica.get("state")),
                    replica,
                    groups.get(actor_name),
                    published.pop(rid, None),
                )
            )
    for info in published.values():  # published, but Serve no longer has it: dead, entry not yet expired
        if info.role == ROUTER_DEPLOYMENT:
            continue  # a router's report expires within seconds: nothing to show meanwhile
        rows.append(_row(info.role, info.replica_id, "GONE", {"node_id": info.node_id}, None, info))
    rows.sort(key=lambda r: (r.role, r.state != "RUNNING", r.replica_id))
    return ClusterStatus(
        app_name=app_name,
        app_status=app.get("status"),
        app_message=app.get("message") or "",
        deployments=deployments,
        replicas=rows,
    )


def _row(
    role: str, replica_id: str, state: str, serve: dict[str, Any], group: Any, info: Published | None
) -> ReplicaRow:
    bundles = list(getattr(group, "bundles", None) or [])
    return ReplicaRow(
        replica_id=replica_id,
        role=role,
        state=state,
        registry=info.registry if info is not None else "missing",
        node_id=serve.get("node_id"),
        node_ip=serve.get("node_ip"),
        actor_name=serve.get("actor_name"),
        placement_group_id=getattr(group, "placement_group_id", None),
        placement_group_state=getattr(group, "state", None),
        gpus=sum(float((b.get("unit_resources") or {}).get("GPU", 0.0)) for b in bundles),
        bundles=len(bundles),
        running=info.running if info else None,
        waiting=info.waiting if info else None,
        kv_cache_usage=info.kv_cache_usage if info else None,
        start_phases=info.start_phases if info else {},
    )


def _registry_state(info: ReplicaInfo) -> str:
    if info.failed:
        return f"failed: {info.failed}"
    if info.draining:
        return "draining"
    return "ready" if info.ready else "starting"


def fetch_registry(
    ray_address: str, app_name: str, timeout_s: float = 10.0, *, local: bool = False
) -> list[Published]:
    """The registry's entries, from a process not yet connected to Ray (the CLI). `local`: the cluster is
    the one-machine cluster `pdserve up` started (on loopback: cluster/ray_auth.py)."""
    import logging

    import ray
    from ray import serve

    if local:
        from cluster.ray_auth import use_loopback_ray

        use_loopback_ray()
    if not ray.is_initialized():
        # Quietly: Ray's connection notes are for logs, not for a command whose output is the answer.
        ray.init(address=ray_address, namespace="pdserve", log_to_driver=False, logging_level=logging.WARNING)
    handle = serve.get_deployment_handle("registry", app_name)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    infos: list[ReplicaInfo] = handle.snapshot.remote().result(timeout_s=timeout_s)
    routers: list[RouterReport] = handle.routers.remote().result(timeout_s=timeout_s)
    return [Published.of_info(info) for info in infos] + [Published.of_router(r) for r in routers]


def registry_through_router(
    dashboard_url: str, app_name: str, target: str | None
) -> tuple[list[Published], str]:
    """The registry's entries from a machine that is not a Ray node: through the router's GetClusterStatus
    (the deployed topology says its port, TLS and token variable; the host is the dashboard's unless
    `target` says otherwise). Returns (entries, "") or ([], why they could not be read)."""
    import os
    from urllib.parse import urlsplit

    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    from cluster.serve_config import running_topology
    from pdserve_client.sdk import PdserveClient, PdserveError

    details = ServeSubmissionClient(dashboard_url).get_serve_details()
    app = (details.get("applications") or {}).get(app_name) or {}
    if not app.get("deployed_app_config"):
        return [], f"no application {app_name!r} is deployed"
    server = running_topology(app["deployed_app_config"]).server
    target = target or f"{urlsplit(dashboard_url).hostname}:{server.grpc_port}"
    token = os.environ.get(server.auth_token_env) if server.auth_token_env else None
    if server.auth_token_env and not token:
        return [], f"the router at {target} wants a token: set {server.auth_token_env}"
    try:
        with PdserveClient(target, token=token, tls=server.tls is not None, timeout=10) as client:
            replicas, routers = client.cluster_status(), client.routers()
    except PdserveError as exc:
        return [], f"the router at {target} did not answer ({exc.code.name}: {exc.message})"
    return [Published.of_replica(r) for r in replicas] + [Published.of_router(r) for r in routers], ""


def render_json(status: ClusterStatus) -> str:
    return json.dumps(msgspec.to_builtins(status), indent=2)


_COLUMNS = (
    "REPLICA",
    "ROLE",
    "STATE",
    "REGISTRY",
    "NODE",
    "GPUS",
    "PLACEMENT GROUP",
    "ACTOR",
    "RUN/WAIT",
    "KV",
    "START",
)


def render_table(status: ClusterStatus) -> str:
    """A fixed-width table; ids as the dashboard shows them (node ids shortened to 12 characters)."""
    head = f"application {status.app_name}: {status.app_status or 'not deployed'}"
    if status.app_message and status.app_status != "RUNNING":
        head += f" ({status.app_message})"
    lines = [head]
    lines.extend(f"  {name}: {state}" for name, state in status.deployments.items())
    if status.registry_unread:
        lines.append(f"  readiness and load not shown: {status.registry_unread}")
    table = [_COLUMNS] + [_cells(r) for r in status.replicas]
    widths = [max(len(row[i]) for row in table) for i in range(len(_COLUMNS))]
    lines.extend(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table
    )
    return "\n".join(lines)


def _cells(r: ReplicaRow) -> tuple[str, ...]:
    load = "-" if r.running is None else f"{r.running}/{'-' if r.waiting is None else r.waiting}"
    kv = "-" if r.kv_cache_usage is None else f"{r.kv_cache_usage:.0%}"
    group = "-" if r.placement_group_id is None else f"{r.placement_group_id} ({r.placement_group_state})"
    node = "-" if r.node_id is None else f"{r.node_id[:12]} {r.node_ip or ''}".strip()
    return (
        r.replica_id,
        r.role,
        r.state,
        r.registry,
        node,
        f"{r.gpus:g}",
        group,
        r.actor_name or "-",
        load,
        kv,
        _start(r.start_phases),
    )


def _start(phases: dict[str, float]) -> str:
    """The start's total and its phases, e.g. `41.2s (actor 3.1, weights 20.4, ...)`."""
    if not phases:
        return "-"
    total = start_phases.start_s(phases)
    ordered = [p for p in start_phases.ORDER if p in phases]  # gRPC's map has no order
    return f"{total:.1f}s (" + ", ".join(f"{p} {phases[p]:.1f}" for p in ordered) + ")"
